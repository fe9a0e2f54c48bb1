/* The public header alone, compiled as strict C99 with warnings as errors,
 * a call of each convention function to prove it links, and the refusal of
 * a struct that its _default() function did not set up. */
#include "graphed.h"

#include <stdio.h>
#include <string.h>

int main(void) {
    const char *v = graphed_version();
    char expected[32];
    snprintf(expected, sizeof expected, "%d.%d.%d", GRAPHED_VERSION_MAJOR, GRAPHED_VERSION_MINOR,
             GRAPHED_VERSION_PATCH);
    if (strcmp(v, expected) != 0 || strcmp(v, GRAPHED_VERSION_STRING) != 0) {
        fprintf(stderr, "version mismatch: library %s, header %s\n", v, expected);
        return 1;
    }
    if (strcmp(graphed_status_name(GRAPHED_STATUS_OK), "GRAPHED_STATUS_OK") != 0) {
        fprintf(stderr, "status name mismatch\n");
        return 1;
    }
    graphed_status s = graphed_device_count(NULL);
    if (s != GRAPHED_STATUS_NULL_POINTER) {
        fprintf(stderr, "graphed_device_count(NULL) returned %s\n", graphed_status_name(s));
        return 1;
    }
    {
        /* A struct not set up by its _default() function is refused, not read. */
        graphed_session_config zeroed;
        graphed_session *session = NULL;
        memset(&zeroed, 0, sizeof zeroed);
        s = graphed_session_create(&zeroed, &session);
        if (s != GRAPHED_STATUS_BAD_STRUCT || session != NULL) {
            fprintf(stderr, "a zeroed config gave %s\n", graphed_status_name(s));
            return 1;
        }
    }
    printf("graphed %s (C99): %s\n", v, graphed_last_error_message());
    return 0;
}
