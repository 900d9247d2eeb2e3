"""End-to-end engine benchmarks on random-weight models of the published geometries (issue 9)."""
