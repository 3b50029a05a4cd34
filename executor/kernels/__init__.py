"""The compiled CPU library: C sources built once per machine with the system C compiler (:mod:`.build`)."""
