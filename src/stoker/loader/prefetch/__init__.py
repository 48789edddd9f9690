"""stoker.loader.prefetch."""
