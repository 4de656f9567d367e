"""The scheduler: one thread owns an engine and runs its prefill and decode work in chunks, by
priority. The HTTP server hosts one (its requests), and so does every Ray worker (its builds and
combine passes); neither is part of the other."""
