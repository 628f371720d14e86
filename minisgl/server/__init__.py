"""The serving stack: arguments, the API server and the launcher of the worker processes."""
