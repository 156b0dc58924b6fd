"""The wire contract: the job message, stream entries and key names, error codes.
Imports nothing else of the worker; the client and the worker both stand on it."""
