"""`pdserve bench`: a load generator for any OpenAI-compatible endpoint (no torch).

`workload` decides which requests are sent and when (arrival processes, length mixes, trace
replay, the command-line spec); the HTTP client and the report build on it.
"""
