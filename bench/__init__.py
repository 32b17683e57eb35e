"""pgcarve's benchmarks, beside the product (`make bench`, `python -m bench`); see bench/README.md."""
