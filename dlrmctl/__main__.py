"""``python -m dlrmctl``: the ``dlrmctl`` command (:func:`dlrmctl.entry.main`)."""

from dlrmctl.entry import main

if __name__ == "__main__":
    main()
