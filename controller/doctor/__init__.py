"""`esd-sweep doctor`: a check's outcome (checks), this machine's checks (local), a cluster's
(kubernetes), and the command (doctor)."""
