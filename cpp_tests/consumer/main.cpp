// Prints the version of the installed graphed it links against, through the
// installed C++ layer.
#include <graphed.hpp>

#include <cstdio>

int main() {
    std::printf("graphed %s\n", graphed::version());
    return 0;
}
