"""Small shared helpers with no minisgl dependencies above them: ZMQ queues and addresses,
process helpers, heartbeats and host-to-device staging."""
