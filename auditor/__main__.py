"""`python -m tokaudit`: the same command line as `tokaudit`."""

from tokaudit.cli import run

if __name__ == "__main__":
    run()
