"""`python -m inferq` is the `inferq` command."""

from inferq.cli import main

if __name__ == "__main__":
    main()
