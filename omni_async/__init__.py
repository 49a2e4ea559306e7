"""omni_async."""
