"""stoker.loader.workers."""
