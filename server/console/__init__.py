"""The console on the management port: its routes, its history, its static files."""
