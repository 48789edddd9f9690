"""stoker.loader.device."""
