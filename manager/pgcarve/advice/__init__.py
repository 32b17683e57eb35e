"""Does carving help on this host? The experiment's cases, load and verdict (`pgcarve advise`,
`POST /v1/advice`, and the benchmark's experiment part all run this one implementation)."""
