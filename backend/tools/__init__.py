"""Offline tools, run from the command line and never by the server: `kumo eval`, `kumo plan`,
`kumo quantize`, and the random checkpoints `kumo serve` starts from."""
