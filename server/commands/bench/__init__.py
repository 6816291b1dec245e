"""`pagedserve bench`: a load generator for a running server (`serve`) and an offline engine
benchmark (`offline`), with JSON results and a PNG of the throughput-latency curve. Talks to
the server over HTTP only; imports no server module besides its own."""
