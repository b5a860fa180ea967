"""`python -m tokaudit`: the same command line as `tokaudit`."""

from tokaudit.cli import main

if __name__ == "__main__":
    main(prog_name="tokaudit")
