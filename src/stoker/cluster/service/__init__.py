"""stoker.cluster.service."""
