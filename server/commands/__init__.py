"""The CLI's commands (serve, archive, prepare, bench); server/cli.py dispatches to them."""
