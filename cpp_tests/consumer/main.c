/* Prints the version of the installed graphed it links against. */
#include <graphed.h>
#include <stdio.h>

int main(void) {
    printf("graphed %s\n", graphed_version());
    return 0;
}
