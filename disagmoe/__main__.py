from disagmoe.cli.app import main

main()
