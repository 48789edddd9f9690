"""stoker.loader.pipeline."""
