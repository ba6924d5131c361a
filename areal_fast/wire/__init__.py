"""What crosses between the controller and the worker processes: typed messages, their msgpack
codec, the controller's worker handles, and shards (metadata and tensor transfer)."""
