"""Small shared helpers: ZMQ queues and addresses, process helpers."""
