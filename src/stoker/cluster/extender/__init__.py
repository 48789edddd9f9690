"""stoker.cluster.extender."""
