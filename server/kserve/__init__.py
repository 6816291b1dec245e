"""KServe's v1 and open-inference v2 surface."""
