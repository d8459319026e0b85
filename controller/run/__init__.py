"""One `esd-sweep run`: the model list to a resume plan (plan), the backend, outcomes into records
(recorder), the run record (runs), its log file (runlog), custom-commands mode's input
(commands), and the sweep that ties them together (sweep)."""
