from ephemeral.cli import main

main()
