"""The embedded synthetic sets: rendered scenes (`scenes`), their captions (`captions`), candidate
boxes (`proposals`), the captioned-scene set (`synth`) and L2C's image-pair set (`pairs`), with
what the two builders share (`embedded_set`)."""
