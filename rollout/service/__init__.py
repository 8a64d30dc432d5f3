"""What every ZMQ front shares: the socket, the exactly-once registry, leases, metrics."""
