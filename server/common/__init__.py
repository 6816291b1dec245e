"""What every part of the front end uses: errors, atomic writes, keys, settings, connections, OpenAPI."""
