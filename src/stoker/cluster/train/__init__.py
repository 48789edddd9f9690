"""stoker.cluster.train."""
