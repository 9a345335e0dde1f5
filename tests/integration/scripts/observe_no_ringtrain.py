"""A script that never uses ringtrain: the doctor has nothing to measure."""

total = sum(i * i for i in range(1000))
print(f"done without ringtrain: {total}")
