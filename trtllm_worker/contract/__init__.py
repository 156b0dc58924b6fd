"""The wire contract: the job message, stream entries and key names, queue and exchange
names, error codes, and the command's exit codes. Imports nothing else of the worker;
the client and the worker both stand on it."""
