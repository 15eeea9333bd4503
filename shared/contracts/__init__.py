"""Contracts defined once: states, backends, configuration, events, commands."""
