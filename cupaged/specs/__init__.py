"""Which kernel specializations exist (:mod:`.catalog`), the host mirrors of their
compile-time geometry (:mod:`.geometry`), and the pairwise covering sets CI compiles
(:mod:`.covering`)."""
