"""The `pgcarve` command line (main.py): commands by what they act on, one HTTP client for the API."""
