from acc_train_cli.main import main

main()
