"""Small data sets generated in the package (no download): `flexgen.datasets.yinyang`, the Yin-Yang data set of
Kriener, Göltz and Petrovici, and its spike-time encoding."""
