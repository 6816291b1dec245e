"""Models -> versions -> workers: the registry, worker pools, routing, lifecycle, memory budget, archives, adapters, snapshots."""
