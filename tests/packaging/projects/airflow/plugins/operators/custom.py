class CustomThing:
    """A trivial class of the user's (plugins-folder copy)."""

    SOURCE = "plugins"
