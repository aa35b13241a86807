"""The driver side: the offline API, the engine's step loop, the scheduler and the KV-block accounting."""
