"""One job on the event loop: intake, the runner, leases, the output pump, detokenizing."""
