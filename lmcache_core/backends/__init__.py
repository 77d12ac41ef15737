"""Built-in plugins. They register through the same hooks as third-party plugins."""
