from jaxpaged.cli import main

main()
