"""The `kumo backend` process (DESIGN.md §3): the HTTP app (`app`), a request's way through the text
side and the engine (`generation`), the served checkpoint's card (`model_card`), the process
settings (`settings`) and its Prometheus metrics (`metrics`)."""
