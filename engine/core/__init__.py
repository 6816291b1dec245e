"""The engine core, its process (busy loop, socket threads), its clients, wire messages and the output processor."""
