"""wrangler-mock: run Python Workers locally against a Kumo gateway."""
