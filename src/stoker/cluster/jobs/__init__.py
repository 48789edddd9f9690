"""stoker.cluster.jobs."""
