"""SpecPrefill's scoring stage (GPU thread only): the draft model that scores a long prompt's
tokens before the row joins a lane, and which library runs it. Imports nothing on its own (its
modules are imported by name)."""
