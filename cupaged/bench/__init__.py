"""``cupaged-bench``: the command line (:mod:`.cli`) and what it measures, on the user's GPU
against the roofline and the peers."""
