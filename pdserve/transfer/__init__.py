"""Moving KV blocks between workers. Backends are chosen by name and imported only when chosen."""
